"""The file format: GGUF reading and writing, overlays, the file quantizer, importance matrices."""
