"""A root of checkpoints by step: listing, ``latest``, set-aside and deletion (``root``), which
checkpoint a path names (``naming``), which steps to keep (``retention``), when to save
(``schedule``), the one writer allowed (``lease``), restoring past a damaged checkpoint
(``restore``) and data loaders across a resume (``loaders``)."""
