"""cost_models: device profiles, clusters, and the time and memory of work on them. Imports nothing of hetpar's but hetpar.vocabulary."""
