"""Real video transformers on the paged cache (optional: needs the ``diffusers`` extra).

``models.wan_paged`` runs a diffusers ``WanTransformer3DModel`` autoregressively, block by block,
with its self-attention reading and writing the paged KV cache through ``paging.forward``.
Nothing in ``kernels``, ``paging`` or ``reference`` imports this package.
"""
