"""One module per hetpar command."""
