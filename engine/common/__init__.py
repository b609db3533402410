"""Types shared by the runtime, the scheduler and the server, the lowest layer of `engine/`:
what a request asks for (`SamplingParams`), what it gets back (`GenerationChunk`, `TokenLogprob`,
`EngineError`) and the tokenizer interface they use (`TokenizerLike`)."""
