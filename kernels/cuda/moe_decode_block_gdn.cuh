// Included last by the op moe_decode_block_gdn (kernels/MANIFEST.toml): builds
// moe_decode_block.cu with its Gated DeltaNet phase (GD, see that file), whose
// extra inputs and outputs only that op's signature has.
#define QAB_BLOCK_GDN 1
