"""Strict settings for every test: highest matmul precision, rank promotion raises, TF32 off."""

import jax
import torch

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
