"""The cached decision of which strategy runs a reduction: the LRU-cached dispatcher, the built-in
rule (cost model, one-shot/two-shot choice) and measured strategy tables."""
