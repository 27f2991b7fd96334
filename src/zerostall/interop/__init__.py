"""Checkpoints leaving zerostall: export to Hugging Face safetensors or a ``torch.save`` file, and
verified copies between locations."""
