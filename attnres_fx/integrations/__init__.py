"""What attnres_fx joins a converted model to: Hugging Face save and load (``hf``), pipeline stages
(``pipelining``), training helpers (``training``) and depth-attention maps (``depth``)."""
