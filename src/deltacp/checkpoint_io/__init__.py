"""Checkpoint I/O in transformers' format: `load_pretrained` (rank-by-rank reads into the CP'd, FSDP2-sharded model),
`save_pretrained` (streamed through rank 0), and the format itself (`hf_format`: files, names, the family's renames).
"""
