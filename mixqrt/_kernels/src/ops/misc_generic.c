/* Generic tier of the float ops (misc_impl.h). */
#define MQ_SFX generic
#include "misc_impl.h"
#include "kvattn_impl.h"
