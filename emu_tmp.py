import torch, itertools
from fusepass.kernels import gdn
torch.manual_seed(0)
def rel(a,b): return ((a.double()-b.double()).norm()/b.double().norm()).item()
def R(x, on): return x.bfloat16().double() if on else x
def emu(q,k,v,g,beta,scale,flags):
    B,T,H,D=q.shape; C=64
    q,k,v,g,beta=(x.transpose(1,2).double() for x in (q,k,v,g,beta))
    q,k=gdn._l2norm(q),gdn._l2norm(k); q=q*scale
    NT=-(-T//C); pad=NT*C-T
    q,k,v=(torch.nn.functional.pad(x,(0,0,0,pad)).reshape(B,H,NT,C,-1) for x in (q,k,v))
    g,beta=(torch.nn.functional.pad(x,(0,pad)).reshape(B,H,NT,C) for x in (g,beta))
    G=g.cumsum(-1); causal=torch.ones(C,C,dtype=torch.bool).tril()
    Dm=(G[...,:,None]-G[...,None,:]).masked_fill(~causal,float('-inf')).exp()
    kr=R(k,flags['k'])
    A=((kr@kr.transpose(-1,-2))*beta[...,:,None]*Dm).tril(-1)
    Tm=gdn._unit_lower_inverse(A)
    Tm=R(Tm,flags['T'])
    w=R(Tm@R(k*(beta*G.exp())[...,None],flags['T']),flags['wu']); u=R(Tm@R(v*beta[...,None],flags['T']),flags['wu'])
    S=torch.zeros(B,H,k.shape[-1],v.shape[-1],dtype=torch.float64)
    o=torch.empty(B,H,NT,C,v.shape[-1],dtype=torch.float64)
    for c in range(NT):
        Sr=R(S,flags['S'])
        vn=u[:,:,c]-w[:,:,c]@Sr
        vr=R(vn,flags['vS']); vo=R(vn,flags['vo'])
        qk=R(q[:,:,c],flags['qk'])@R(k[:,:,c],flags['qk']).transpose(-1,-2)*Dm[:,:,c]
        o[:,:,c]=R(q[:,:,c]*G[:,:,c,:,None].exp(),flags['qk'])@Sr+R(qk,flags['vo'])@vo
        Gl=G[:,:,c,-1]
        S=S*Gl.exp()[...,None,None]+R(k[:,:,c]*(Gl[...,None]-G[:,:,c]).exp()[...,None],flags['k']).transpose(-1,-2)@vr
    o=o.reshape(B,H,NT*C,-1)[:,:,:T].transpose(1,2)
    return R(o,True), S
B,T,H,dk,dv=1,256,2,128,128
q=torch.randn(B,T,H,dk).bfloat16(); k=torch.randn(B,T,H,dk).bfloat16(); v=torch.randn(B,T,H,dv).bfloat16()
g=torch.nn.functional.logsigmoid(torch.randn(B,T,H)+3)*1.0; beta=torch.rand(B,T,H).sigmoid().bfloat16()
ref=gdn.gdn_reference(q,k,v,g,beta,None,True,dk**-0.5,compute_dtype=torch.float64)
names=['k','T','wu','S','vS','vo','qk']
for on in [tuple(names), ('k','T','wu','S','vS'), ('k','T','wu','S','vS','qk'), ('k','wu','S','vS'), ('k','T','wu','S','vS','vo')]:
    f={n:(n in on) for n in names}
    o,S=emu(q,k,v,g,beta,dk**-0.5,f); print(on, "%.2e %.2e"%(rel(o,ref[0]),rel(S,ref[1])))
