"""arfusion inside SGLang: a plugin (entry point ``sglang.srt.plugins``: ``arfusion``) that puts
arfusion's fused all-reduce + residual add + RMSNorm and its cached dispatch in the place of
SGLang's flashinfer fusion, with no change to SGLang. On with SGLang's
``--enable-flashinfer-allreduce-fusion`` and ``ARFUSION_SGLANG=1``.

    plugin.py       the entry point: the option, the version check, the hook registration
    hooks.py        the replacements of SGLang's gate, fused call and workspace life cycle
    runtime.py      the process's fusion op: made, grown, freed; its status and counters
    group.py        SGLang's GroupCoordinator as arfusion's TensorParallelGroup
    layer_scope.py  which layer's reduction runs (the layer_id of the cached decision)
    versions.py     the supported SGLang releases
"""
