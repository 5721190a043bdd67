import os; os.environ["TRITON_INTERPRET"]="1"
import torch
from fusepass.kernels import gdn
torch.manual_seed(0)
def rel(a,b): return ((a.double()-b.double()).norm()/b.double().norm()).item()
B,T,Hk,Hv,dk,dv=1,130,1,2,32,32
for gs in (0.5, 0.05):
  q=torch.randn(B,T,Hk,dk).bfloat16(); k=torch.randn(B,T,Hk,dk).bfloat16(); v=torch.randn(B,T,Hv,dv).bfloat16()
  g=-torch.rand(B,T,Hv)*gs; beta=torch.rand(B,T,Hv).bfloat16(); s0=None
  ref=gdn.gdn_reference(q,k,v,g,beta,s0,True,dk**-0.5,compute_dtype=torch.float64)
  print("floor", rel(ref[0].bfloat16(), ref[0]))
  o,S=gdn.gdn_chunk_fwd(q,k,v,g,beta,s0,True,dk**-0.5); print("bf16 kernel", rel(o,ref[0]), rel(S,ref[1]))
  o,S=gdn.gdn_chunk_fwd(q.float(),k.float(),v.float(),g,beta.float(),s0,True,dk**-0.5); print("fp32 kernel", rel(o,ref[0]), rel(S,ref[1]))
  o,S=gdn.gdn_recurrent_fwd(q,k,v,g,beta,s0,True,dk**-0.5); print("rec", rel(o,ref[0]), rel(S,ref[1]))
