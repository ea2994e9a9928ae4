#!/bin/bash
# Adds llama.cpp's `llama-server` to a pruned llama.cpp tree made by ../shared/tools/peer-llama/prepare.sh (which
# keeps only llama-bench and llama-quantize: it has no tools/server), from the same source distribution
# (llama-cpp-python 0.3.36 on PyPI), so that scripts/device-serve.sh can build it on the GPU box. Run it HERE
# (it downloads the sdist), before the tree is carried. Adds ~8 MB: tools/server (less its bench and tests), tools/mtmd
# (the server links it), tools/ui's CMake files (the web UI is built empty: no npm and no download on the box;
# the API does not need it), scripts/ui-assets.cmake, vendor/stb and vendor/miniaudio (4 MB; mtmd includes them).
# usage: peer-llama-server.sh LLAMA_DIR        (the folder prepare.sh wrote, e.g. peer/llama.cpp)
# Then build with  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF  and target llama-server.
set -e
DEST=${1:?usage: peer-llama-server.sh LLAMA_DIR}; VER=0.3.36
[ -d "$DEST/tools/llama-bench" ] || { echo "$DEST is not a tree prepare.sh wrote"; exit 1; }
T=$(mktemp -d); trap 'rm -rf $T' EXIT
# SDIST=path/llama_cpp_python-0.3.36.tar.gz reuses a download.
if [ -n "$SDIST" ]; then cp "$SDIST" $T/; else
    pip download -q --no-deps --no-binary :all: --no-build-isolation llama-cpp-python==$VER -d $T; fi
tar xzf $T/llama_cpp_python-$VER.tar.gz -C $T; S=$T/llama_cpp_python-$VER/vendor/llama.cpp
mkdir -p $DEST/tools/ui $DEST/scripts
rm -rf $DEST/tools/server $DEST/tools/mtmd
cp -r $S/tools/server $S/tools/mtmd $DEST/tools/
rm -rf $DEST/tools/server/bench $DEST/tools/server/tests
cp $S/tools/ui/CMakeLists.txt $S/tools/ui/sources.cmake $S/tools/ui/ui.cpp.in $S/tools/ui/ui.h.in $DEST/tools/ui/
cp $S/scripts/ui-assets.cmake $DEST/scripts/
cp -r $S/vendor/stb $S/vendor/miniaudio $DEST/vendor/
cp $S/vendor/CMakeLists.txt $DEST/vendor/CMakeLists.txt
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\nadd_subdirectory(quantize)\nif (LLAMA_BUILD_SERVER)\n    add_subdirectory(ui)\n    add_subdirectory(server)\nendif()\nadd_subdirectory(mtmd)\n' > $DEST/tools/CMakeLists.txt
du -sh $DEST
