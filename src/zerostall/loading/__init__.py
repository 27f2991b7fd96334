"""Reading: open (a manifest of ours, or one translated from a foreign checkpoint) → load plan →
fetch (and broadcast) → every block verified; the ``Checkpoint`` session in front, ``verify`` and
tensor streams for exporters beside them."""
