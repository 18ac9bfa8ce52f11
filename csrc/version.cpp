#include "llama-pyspecter.h"

int32_t llama_pyspecter_version(void) {
    return LLAMA_PYSPECTER_VERSION;
}
