"""Checks that build and verify both ask of a module: does it read each mask as declared
(``mask_probe``), what do fully masked rows give (``fully_masked``), and do its decode
trajectories with a key/value cache agree with the graph's (``decode``)."""
