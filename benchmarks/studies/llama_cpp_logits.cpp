// llama.cpp's own logits for a token sequence, for benchmarks/studies/agreement.py's `--llama-logits` comparison.
//
// Not part of verispec: build it against a llama.cpp checkout you built yourself (CMake, the `llama` target), e.g.
//   g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include benchmarks/studies/llama_cpp_logits.cpp \
//       -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin -o llama_cpp_logits
//
// Usage: llama_cpp_logits MODEL.gguf THREADS FIRST < ids.txt > logits.f32
//   ids.txt: the token ids, whitespace-separated (no BOS is added: pass the ids exactly as the model should see
//   them). The whole sequence is evaluated in one batch with llama.cpp's default context settings (f16 KV cache,
//   no flash attention); the logits of positions FIRST .. n-1 are written to stdout as raw float32,
//   [n - FIRST, n_vocab] row-major. The vocabulary size goes to stderr as "n_vocab N".
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS FIRST < ids.txt > logits.f32\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]), first = atoi(argv[3]);
    std::vector<llama_token> ids;
    for (long v; scanf("%ld", &v) == 1;) ids.push_back((llama_token)v);
    const int n = (int)ids.size();
    if (n == 0 || first < 0 || first >= n) {
        fprintf(stderr, "need at least one token and 0 <= FIRST < n (got n = %d, FIRST = %d)\n", n, first);
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    ggml_backend_load_all();
    llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t)n;
    cp.n_threads = cp.n_threads_batch = threads;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context of %d positions\n", n);
        return 1;
    }
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i >= first;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch)) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    fprintf(stderr, "n_vocab %d\n", n_vocab);
    for (int i = first; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t)n_vocab, stdout);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
