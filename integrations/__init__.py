"""Adapters that put this project's kernels behind other engines' attention call sites.

``paged_video.integrations.vllm_omni`` routes vllm-omni's AR-Diffusion paged self-attention to
``paged_video.kernels``. Importing this package loads nothing heavy.
"""

if __name__ != "paged_video.integrations":  # a bare `import integrations` found this clone's folder
    from paged_video._clone import hand_over

    hand_over(__name__, __file__)
