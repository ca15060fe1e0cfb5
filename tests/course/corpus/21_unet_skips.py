# %% [markdown]
# A U-Net in miniature as segmentation tutorials write it: double-conv blocks with batch
# norm, max-pool down, transposed-conv up, the skip connections concatenated with
# `torch.cat`, a 1x1 conv to one mask channel, BCEWithLogitsLoss, Adam.

# %% tags=["setup"]
import torch
from torch import nn

device = "cuda"

def double_conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

class UNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.down1, self.down2, self.bottom = double_conv(3, c), double_conv(c, 2 * c), double_conv(2 * c, 4 * c)
        self.pool = nn.MaxPool2d(2)
        self.up2, self.conv2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), double_conv(4 * c, 2 * c)
        self.up1, self.conv1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2), double_conv(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)
    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        b = self.bottom(self.pool(d2))
        u2 = self.conv2(torch.cat([self.up2(b), d2], dim=1))
        u1 = self.conv1(torch.cat([self.up1(u2), d1], dim=1))
        return self.out(u1)

model = UNet().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.BCEWithLogitsLoss()
images = torch.randn(16, 3, 64, 64, device=device)
masks = (torch.rand(16, 1, 64, 64, device=device) > 0.5).float()

# %% tags=["step"]
for _ in range(2):
    optimizer.zero_grad()
    loss = criterion(model(images), masks)
    loss.backward()
    optimizer.step()

# %% tags=["check"]
def dc(cin, cout):   # two 3x3 convs with biases, two batch norms (weight, bias)
    return [cout * cin * 9, cout, cout, cout, cout * cout * 9, cout, cout, cout]
c = 16
sizes = dc(3, c) + dc(c, 2 * c) + dc(2 * c, 4 * c) + [4 * c * 2 * c * 4, 2 * c] + dc(4 * c, 2 * c) \
    + [2 * c * c * 4, c] + dc(2 * c, c) + [c, 1]
params = sum(rnd(n * 4) for n in sizes)
assert r.breakdown["parameters"] == params
# each batch norm: running mean, running var (fp32) and an int64 counter
buffers = sum(2 * rnd(n * 4) + rnd(8) for n in [c, c, 2 * c, 2 * c, 4 * c, 4 * c, 2 * c, 2 * c, c, c])
assert r.breakdown["buffers"] == buffers
assert r.before == params + buffers + rnd(16 * 3 * 64 * 64 * 4) + rnd(16 * 64 * 64 * 4)
# gradients stay after the last step (zero_grad comes first) with Adam's two moments
assert r.breakdown["optimizer_state"] in (0, 2 * params)
kept = 3 * params + rnd(4)
assert kept <= r.after - r.before <= kept + 2 * MiB, (r.after - r.before, kept)
# activations, in channels of one image's map, saved at the end of the forward: a double
# conv (cin -> cout) saves conv1's input (cin), BN1's input, the in-place ReLU's output
# (= conv2's input), BN2's input and ReLU2's output (4 cout); a max-pool its int64 indices
# (2 fp32 channels each); the transposed convs save inputs already counted; the cats feed
# the up blocks (their cin); BCE saves the 1-channel logits.
#   64x64: down1 3 + 64, conv1 32 + 64, logits 1           = 164 channels
#   32x32: pool1 indices 2 x 16, down2 16 + 128, conv2 64 + 128 = 368 channels
#   16x16: pool2 indices 2 x 32, bottom 32 + 256             = 352 channels
# the input x (3 channels at 64x64) was there before; batch norm's per-channel statistics
# are a few KiB. The backward frees from the top, so the peak has at most all of them:
per_image = 4 * (164 * 4096 + 368 * 1024 + 352 * 256)          # 4,554,752 B
assert r.breakdown["activations"] <= 16 * per_image + 10 * MiB // 64, r.breakdown["activations"]
# and at least 64 channels of 64x64 maps (down1's four 16-channel ones, which the
# backward frees last)
assert r.breakdown["activations"] >= 16 * 4 * 64 * 4096, r.breakdown["activations"]

# %% tags=["corpus"]
# a bigger batch of images (memmagic resizes `images` and `masks`); fp16 autocast halves the
# convolutions' saved outputs; no_grad keeps nothing for backward
WHATIF = [("batch_size", 32, "up"), ("amp", "fp16", "down"), ("grad_mode", "no_grad", "down")]
