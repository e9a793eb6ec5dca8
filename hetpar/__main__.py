"""``python -m hetpar`` runs the CLI."""

from hetpar.cli import main

main()
