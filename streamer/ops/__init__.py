"""Byte views, float casts and quantization kernels, shared by the live (refit) and offline (convert) paths."""

from __future__ import annotations
