// Decode KV cache write, IN PLACE: the new key and value rows of one token go
// straight into the preallocated cache buffers, and the step's attention mask
// comes out as this kernel's output.
//
// Why in place: the compiled decode step used mx.slice_update on the whole
// buffer, and MLX copies an input it cannot donate; on CUDA the previous
// token's attention still holds the buffer while the next token is encoded
// (two steps in flight), so every token copied every full-attention layer's
// K and V buffers (measured on the H200 at a 128K context: about 1 ms per
// layer, 10 of the 19.6 ms of GPU time per token). The caller must own the
// buffers exclusively (decode.py makes a private copy before the first
// in-place write) and must feed `mask` to the attention that reads the
// buffers: it is the only data dependency that orders that read after this
// write (MLX does not know the buffers change).
//
//   k_buf[b, h, offset, :] = k_new[b, h, 0, :]    (same for v)
//   mask[s] = s <= offset                          (s < S)
//
// Launch: grid (N, 1, 1) threads, threadgroup (256, 1, 1), with N =
// max(S, B * Hk * D) rounded up to a multiple of 256. Inputs: k_new, v_new [B, Hk, 1, D] InT,
// any strides (read through them: RoPE's output arrives transposed, and an
// explicit contiguous copy was a primitive per layer and token); k_buf, v_buf
// [B, Hk, S, D] InT, any strides (read through them, written through them);
// offset: one int32 element, any shape (0 <= offset < S).
// Output: mask [1, 1, 1, S] bool.

const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
const long S = k_buf_shape[2];
const int off = offset[0];
if (i < S) {
  mask[i] = i <= off;
}
const int Hk = k_buf_shape[1];
const int D = k_buf_shape[3];
if (i < (long)k_buf_shape[0] * Hk * D) {
  const long d = i % D;
  const long h = (i / D) % Hk;
  const long b = i / ((long)D * Hk);
  const long ko = b * k_buf_strides[0] + h * k_buf_strides[1] + off * k_buf_strides[2]
                  + d * k_buf_strides[3];
  const long vo = b * v_buf_strides[0] + h * v_buf_strides[1] + off * v_buf_strides[2]
                  + d * v_buf_strides[3];
  const long kn = b * k_new_strides[0] + h * k_new_strides[1] + d * k_new_strides[3];
  const long vn = b * v_new_strides[0] + h * v_new_strides[1] + d * v_new_strides[3];
  const_cast<InT*>(k_buf)[ko] = k_new[kn];
  const_cast<InT*>(v_buf)[vo] = v_new[vn];
}
