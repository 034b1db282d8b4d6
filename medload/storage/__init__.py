"""medload.storage: the LMDB slice store -- format, single writer, reader, NIfTI export."""
