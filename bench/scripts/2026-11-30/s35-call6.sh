#!/usr/bin/env bash
# Session 35, call 6 (H200): #40's prep on a fresh machine (llama.cpp built with CUDA, glm-4.5-air
# and gpt-oss-120b synthesized at 4 layers, their GGUF files and Krasis caches); call 7 follows on
# the same machine.
SECTIONS=prep bash scripts/device-fp4.sh 2>&1 | tail -6
