"""Framework interop by contract: one module per framework whose objects evenly must
recognise (HF Accelerate, and so the HF Trainer), each pinned by an internals test."""
