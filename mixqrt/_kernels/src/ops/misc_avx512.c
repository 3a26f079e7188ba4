#define MQ_SFX avx512
#include "misc_impl.h"
#include "kvattn_impl.h"
