def reconstruct_indices_from_tree_mask(*args, **kwargs):
    raise RuntimeError("sgl_kernel stub: reconstruct_indices_from_tree_mask needs a CUDA GPU")
