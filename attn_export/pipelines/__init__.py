"""The commands as library functions: ``build``, ``verify``, ``bench`` and ``inspect``, each
returning result dataclasses that ``report/`` renders."""
