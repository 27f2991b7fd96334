"""Saving: collect → plan → write → commit (``pipeline`` runs them in order), and the asynchronous
saver that captures the state into host buffers first and persists from them, in a thread or a
writer process."""
