"""The on-disk contract: the manifest and data-file layout, the python-value codec, block checksums,
tensor boxes and subclasses, and the checks that turn untrusted manifest bytes into a ``Manifest``.
Nothing here does I/O."""
