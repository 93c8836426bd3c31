"""The refusal table's core (`compatibility.py`: what dynamic CP cannot run with; each drop-in
registers its own rows) and the docs' refusal tables generated from it (`refusal_docs.py`)."""
