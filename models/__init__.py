"""Real video transformers on the paged cache (optional: needs the ``diffusers`` extra).

``models.wan_paged`` runs a diffusers ``WanTransformer3DModel`` autoregressively, block by block,
with its self-attention reading and writing the paged KV cache through ``paging.forward``.
``models.parallel`` runs that rollout over ranks of ``torch.distributed`` (Ulysses sequence
parallel, CFG parallel); ``models.distributed`` is its torch-only plumbing.
Nothing in ``kernels``, ``paging`` or ``reference`` imports this package.
"""

if __name__ != "paged_video.models":  # a bare `import models` found this clone's folder
    from paged_video._clone import hand_over

    hand_over(__name__, __file__)
