"""Model building blocks: attention over the paged cache, rotary embeddings, norms, sampler."""
