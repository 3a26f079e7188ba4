#define MQ_SFX avx2
#include "misc_impl.h"
#include "kvattn_impl.h"
