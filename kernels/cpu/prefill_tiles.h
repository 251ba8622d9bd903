// paged_decode's prompt rows as tile products: AMX tiles or vdpbf16ps (prefill_tiles.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

// Attends the runs of 8 to 16 consecutive query rows of one sequence (one table row, each row
// seeing one key more than the one before) as tile products, where the CPU has AMX-BF16 or
// AVX512-BF16 and d is a multiple of 64, writing their outputs; returns the indices of the query
// rows it left to the caller (all of them where it takes none: also where a row reaches past
// `window`, when > 0). Arguments as paged_decode's (bfloat16 q, out and pool, 16-token blocks);
// table_rows may be null (no runs then).
std::vector<int64_t> prefill_rows_tiled(c10::BFloat16* out, int64_t os0, int64_t os1, const c10::BFloat16* q,
                                        int64_t qs0, int64_t qs1, const c10::BFloat16* kv, int64_t ks0, int64_t ks1,
                                        int64_t ks2, int64_t ks3, const int64_t* rows, const int64_t* lens,
                                        const int64_t* table_rows, const int64_t* tables, int64_t max_blocks,
                                        int64_t n_rows, int64_t kv_heads, int64_t groups, int64_t d, float scale,
                                        int64_t window);

// Take the runs on AMX tiles where the CPU has them (true, the default) or in vdpbf16ps (false),
// from now on, in this process; returns the previous setting.
bool use_prefill_amx(bool on);
