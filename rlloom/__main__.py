"""`python -m rlloom ...`, which is how torchrun starts it: torchrun --nproc_per_node 2 -m rlloom
train ..."""
from rlloom.cli import main

main()
