"""A transformers user's script, as written for a Hub checkpoint (tests/test_hf_dropin.py).

The test runs it with only the model id replaced by a GGUF path: once with its transformers
import line changed to take the three names from ``qllama.hf``, once unmodified under
``python -m qllama.hf``. It prints what it got as one JSON line.
"""

import json
from threading import Thread

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, pipeline

MODEL = "Qwen/Qwen2-7B"
PROMPTS = ["The capital of France is", "Hi"]

model = AutoModelForCausalLM.from_pretrained(
    MODEL,
    device_map="auto",
    torch_dtype=torch.float16,
    n_ctx=4096,
    n_threads=8,
    n_gpu_layers=100,
)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
results = {
    "class": type(model).__name__,
    "device": str(model.device),
    "parameters": sum(p.numel() for p in model.parameters()),
}

inputs = tokenizer(PROMPTS[0], return_tensors="pt").to(model.device)
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, temperature=0.0, top_p=1.0)
results["greedy"] = out[0, inputs["input_ids"].shape[1] :].tolist()

batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(model.device)
out = model.generate(**batch, max_new_tokens=8, do_sample=False)
results["batch"] = out[:, batch["input_ids"].shape[1] :].tolist()

streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
thread = Thread(
    target=model.generate,
    kwargs=dict(**inputs, streamer=streamer, max_new_tokens=8, do_sample=False),
)
thread.start()
results["streamed"] = "".join(streamer)
thread.join()

generator = pipeline("text-generation", model=MODEL, device_map="auto", torch_dtype=torch.float16)
out = generator(PROMPTS, max_new_tokens=8, do_sample=False, return_full_text=False, batch_size=2)
results["pipeline"] = [o[0]["generated_text"] for o in out]
chat = [{"role": "user", "content": "What is the capital of France?"}]
out = generator(chat, max_new_tokens=8, do_sample=False)
results["chat"] = out[0]["generated_text"][-1]["content"]

print(json.dumps(results))
