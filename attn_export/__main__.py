"""``python -m attn_export`` runs the command-line interface."""

from attn_export.cli import main

main()
