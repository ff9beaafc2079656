"""Renderers: they format result dataclasses and compute nothing."""
