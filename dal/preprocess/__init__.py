"""Folded input preprocessing: the exported model takes the raw uint8 images the board delivers."""
from .prehead import PreHead, WithPreHead, with_prehead

__all__ = ["PreHead", "WithPreHead", "with_prehead"]
