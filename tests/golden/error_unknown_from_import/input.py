from macrogen import fused_allreduse
