/* Every position's logits from llama.cpp for given KV cache types (docs/kv_cache.md).

   usage: llama_logits MODEL TOKENS TYPE_K TYPE_V FLASH THREADS UBATCH OUT
     TOKENS  a text file of token ids (whitespace-separated)
     FLASH   1: flash attention on, 0: off
     UBATCH  tokens per llama_decode call (1: token by token); the context is 1024
     OUT     float32 logits, n_tokens x n_vocab, row-major

   build against the tools `nox -s peers` builds (tools/llama_cpp_build.py):
     cc -O2 -o llama_logits tools/llama_logits.c -I$LLAMA/include -I$LLAMA/ggml/include \
        -L$BIN -lllama -lggml -lggml-base -Wl,-rpath,$BIN
   with LLAMA the llama.cpp source and BIN its build's bin folder. */
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static enum ggml_type ty(const char *s) {
    const char *n[] = {"f32","f16","bf16","q8_0","q4_0","q4_1","iq4_nl","q5_0","q5_1"};
    enum ggml_type t[] = {GGML_TYPE_F32,GGML_TYPE_F16,GGML_TYPE_BF16,GGML_TYPE_Q8_0,GGML_TYPE_Q4_0,GGML_TYPE_Q4_1,GGML_TYPE_IQ4_NL,GGML_TYPE_Q5_0,GGML_TYPE_Q5_1};
    for (int i = 0; i < 9; i++) if (!strcmp(s, n[i])) return t[i];
    fprintf(stderr, "bad type %s\n", s); exit(1);
}
int main(int argc, char **argv) {
    if (argc != 9) { fprintf(stderr, "usage\n"); return 1; }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    FILE *f = fopen(argv[2], "r"); int toks[8192]; int n = 0;
    while (n < 8192 && fscanf(f, "%d", &toks[n]) == 1) n++;
    fclose(f);
    int ub = atoi(argv[7]);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024; cp.n_batch = ub; cp.n_ubatch = ub; cp.n_seq_max = 1;
    cp.type_k = ty(argv[3]); cp.type_v = ty(argv[4]);
    cp.flash_attn_type = atoi(argv[5]) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.n_threads = cp.n_threads_batch = atoi(argv[6]);
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context refused\n"); return 2; }
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[8], "wb");
    for (int a = 0; a < n; a += ub) {
        int m = n - a < ub ? n - a : ub;
        struct llama_batch b = llama_batch_init(m, 0, 1);
        for (int i = 0; i < m; i++) { b.token[i] = toks[a+i]; b.pos[i] = a+i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1; }
        b.n_tokens = m;
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 3; }
        for (int i = 0; i < m; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), nv, out);
        llama_batch_free(b);
    }
    fclose(out);
    llama_free(ctx); llama_model_free(model);
    return 0;
}
