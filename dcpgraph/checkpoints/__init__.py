"""Reading HF checkpoint directories: used by :mod:`dcpgraph.api`, :mod:`dcpgraph.speculative` and
:mod:`dcpgraph.serving`, and importing none of them.

- :mod:`.model_dir`: a model directory checked up front (config, tokenizer, weight files);
- :mod:`.files`: the safetensors files and dtypes of a directory;
- :mod:`.tensor_sources`: where each tensor of a rank's slice comes from (files, concatenations,
  stacks, in-memory tensors);
- :mod:`.names`: checkpoint names for a model's parameters (transformers' conversion mapping);
- :mod:`.quantization`: fp8 block-quantized checkpoints, dequantized at load;
- :mod:`.meta_trace`: tracing a model built on the meta device;
- :mod:`.loader`: :func:`~.loader.load_program`, each rank reading only its slices.
"""
