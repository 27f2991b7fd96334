"""Emergency checkpoints: a node-local tier, replicas on other nodes, restore from the fastest verified copy."""
