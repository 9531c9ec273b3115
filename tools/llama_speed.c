/* llama.cpp's decode and teacher-forcing speed on one file, for the bench (benchmarks/moe.py).

   usage: llama_speed MODEL TOKENS THREADS PROMPT STEPS WARMUP REPEATS
     TOKENS   a text file of token ids (whitespace-separated); teacher forcing runs all of them
     PROMPT   decode starts after this many tokens (one llama_decode call)
     STEPS    timed decode steps, one token a call, after WARMUP untimed ones
     REPEATS  runs of each measure; the output has every run's seconds
   prints one JSON line: load seconds, each run's decode and teacher-forcing seconds of wall
   time and of the process's CPU time (all its threads), and the peak RSS (VmHWM, MiB) after
   decoding and at the end.

   Teacher forcing: every token in one batch (n_batch = n_ubatch = the tokens), every
   position's logits; the KV cache cleared before each run.

   build against the tools `nox -s peers` builds (tools/llama_cpp_build.py):
     cc -O2 -o llama_speed tools/llama_speed.c -I$LLAMA/include -I$LLAMA/ggml/include \
        -L$BIN -lllama -lggml -lggml-base -Wl,-rpath,$BIN
   with LLAMA the llama.cpp source and BIN its build's bin folder. */
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double clock_s(clockid_t which) {
    struct timespec t;
    clock_gettime(which, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static double now(void) { return clock_s(CLOCK_MONOTONIC); }
static double cpu(void) { return clock_s(CLOCK_PROCESS_CPUTIME_ID); }  /* all threads */

static double peak_mb(void) {  /* VmHWM of /proc/self/status */
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atof(line + 6);
    if (f) fclose(f);
    return kb / 1024;
}

/* tokens toks[0..m) at positions pos.., the last one's logits (all: every one's) */
static int run(struct llama_context *ctx, const int *toks, int m, int pos, int all) {
    struct llama_batch b = llama_batch_init(m, 0, 1);
    for (int i = 0; i < m; i++) {
        b.token[i] = toks[i]; b.pos[i] = pos + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
        b.logits[i] = all || i == m - 1;
    }
    b.n_tokens = m;
    int rc = llama_decode(ctx, b);
    llama_synchronize(ctx);
    llama_batch_free(b);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 8) { fprintf(stderr, "usage: see the source\n"); return 1; }
    int threads = atoi(argv[3]), prompt = atoi(argv[4]), steps = atoi(argv[5]);
    int warm = atoi(argv[6]), repeats = atoi(argv[7]);
    FILE *f = fopen(argv[2], "r");
    if (!f) { fprintf(stderr, "cannot read %s\n", argv[2]); return 1; }
    static int toks[8192];
    int n = 0;
    while (n < 8192 && fscanf(f, "%d", &toks[n]) == 1) n++;
    fclose(f);
    if (prompt + warm + steps > n) { fprintf(stderr, "too few tokens\n"); return 1; }
    llama_backend_init();
    double t0 = now();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "model refused\n"); return 2; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n > 512 ? n : 512; cp.n_batch = n; cp.n_ubatch = n; cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = threads;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context refused\n"); return 2; }
    double load = now() - t0;
    llama_memory_t mem = llama_get_memory(ctx);
    double dw[64], dc[64], tw[64], tc[64];
    if (repeats > 64) repeats = 64;
    for (int r = 0; r < repeats; r++) {
        llama_memory_clear(mem, 1);
        if (run(ctx, toks, prompt, 0, 0)) return 3;
        double t = 0, c = 0;
        for (int i = 0; i < warm + steps; i++) {
            if (i == warm) { t = now(); c = cpu(); }
            if (run(ctx, toks + prompt + i, 1, prompt + i, 0)) return 3;
        }
        dw[r] = now() - t; dc[r] = cpu() - c;
    }
    double decode_peak = peak_mb();
    for (int r = 0; r < repeats + 1; r++) {  /* the first run untimed: buffers, pages */
        llama_memory_clear(mem, 1);
        double t = now(), c = cpu();
        if (run(ctx, toks, n, 0, 1)) return 3;
        if (r) { tw[r - 1] = now() - t; tc[r - 1] = cpu() - c; }
    }
    const char *names[] = {"decode_s", "decode_cpu_s", "tf_s", "tf_cpu_s"};
    double *runs[] = {dw, dc, tw, tc};
    printf("{\"load_s\": %.4f", load);
    for (int m = 0; m < 4; m++) {
        printf(", \"%s\": [", names[m]);
        for (int r = 0; r < repeats; r++) printf("%s%.6f", r ? ", " : "", runs[m][r]);
        printf("]");
    }
    printf(", \"decode_peak_rss_mb\": %.1f, \"peak_rss_mb\": %.1f, \"tokens\": %d}\n",
           decode_peak, peak_mb(), n);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
