// Decode KV cache write, IN PLACE, and the step's attention mask; same
// contract as kernels/cuda/kv_cache_write.cu (read that file's comment: the
// caller owns the buffers and feeds `mask` to the attention that reads them).
// Never run where it was written: used only after its on-device self-check
// passes.
//
// Launch: grid (N, 1, 1) threads, threadgroup (256, 1, 1), with N =
// max(S, B * Hk * D) rounded up to a multiple of 256. k_new / v_new are read
// through their strides too; offset is [1] (a 0-d input would be a reference).

const long i = long(thread_position_in_grid.x);
const long S = k_buf_shape[2];
const int off = offset[0];
if (i < S) {
  mask[i] = i <= off;
}
const int Hk = k_buf_shape[1];
const int D = k_buf_shape[3];
if (i < long(k_buf_shape[0]) * Hk * D) {
  const long d = i % D;
  const long h = (i / D) % Hk;
  const long b = i / (long(D) * Hk);
  const long ko = b * k_buf_strides[0] + h * k_buf_strides[1] + off * k_buf_strides[2]
                  + d * k_buf_strides[3];
  const long vo = b * v_buf_strides[0] + h * v_buf_strides[1] + off * v_buf_strides[2]
                  + d * v_buf_strides[3];
  const long kn = b * k_new_strides[0] + h * k_new_strides[1] + d * k_new_strides[3];
  const long vn = b * v_new_strides[0] + h * v_new_strides[1] + d * v_new_strides[3];
  ((device InT*)k_buf)[ko] = k_new[kn];
  ((device InT*)v_buf)[vo] = v_new[vn];
}
