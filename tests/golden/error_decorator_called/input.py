import macrogen as mg
from torchvision.models import ResNet, resnet18

Net = mg.data_parallel()(ResNet)
model = mg.data_parallel(bucket_mb=4)(resnet18(num_classes=10))
