"""The bottom layer: the formula's ops, argument checks, masking and the band, dropout, autocast."""
