"""``python -m attn_export`` runs the command-line interface."""

from attn_export.cli import main

if __name__ == "__main__":  # not in the processes of --jobs, which import this module again
    main()
