"""A root of checkpoints by step: listing, ``latest``, set-aside and deletion (``root``), which
steps to keep (``retention``), when to save (``schedule``) and the one writer allowed (``lease``)."""
