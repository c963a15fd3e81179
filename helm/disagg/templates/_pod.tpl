{{/*
The pod template of a Ray pod (head or worker group). Arguments (a dict):
  root      the chart's root context
  node      "head" or the worker group's name
  spec      the head values or one workerGroups entry (cpus, memoryGi, gpus, ...)
  shmGi     size of the memory-backed /dev/shm
  disk      whether the disk-tier volume is mounted

Security scan exceptions (checkov; tests/deploy/test_checkov.py accepts no others):
  CKV_K8S_8, CKV_K8S_9  liveness/readiness probes: KubeRay injects Ray's own probes (raylet
                        and dashboard-agent health) into the Ray containers it creates.
  CKV_K8S_22            read-only root filesystem: Ray writes its session directory
                        (/tmp/ray), logs and spill files, and ROCm/Triton/vLLM write kernel
                        caches under $HOME. Nothing there outlives the pod.
  CKV_K8S_23, CKV_K8S_40  non-root, high UID: the ROCm and CUDA vLLM images run as root
                        (GPU device nodes and their caches assume it). Privilege escalation
                        stays off and every capability is dropped (CKV_K8S_20/28/37 pass).
  CKV_K8S_43            image digest: used when image.digest is set; the examples pin a tag
                        because the digest of a site's build is site-specific.
  CKV_K8S_15            pull policy Always: multi-GB images under pinned tags.
  CKV_K8S_38            service-account token (head only): the autoscaler sidecar KubeRay
                        adds to the head pod calls the Kubernetes API with it.
Not skipped: CKV_K8S_35 (the API keys are mounted as files, never env vars), resource
requests/limits, seccomp, NET_RAW, NetworkPolicy (templates/networkpolicy.yaml).
*/}}
{{- define "disagg.podTemplate" -}}
{{- $root := .root -}}
{{- $spec := .spec -}}
{{- $isHead := eq .node "head" -}}
{{- $secret := include "disagg.apiKeySecret" $root -}}
{{- $disk := and .disk $root.Values.app.transfer $root.Values.app.transfer.disk $root.Values.app.transfer.disk.enabled -}}
metadata:
  labels:
    {{- include "disagg.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ ternary "ray-head" "ray-worker" $isHead }}
    disagg.io/node-group: {{ .node }}
  annotations:
    checkov.io/skip1: CKV_K8S_8=KubeRay injects the Ray liveness probe into Ray containers
    checkov.io/skip2: CKV_K8S_9=KubeRay injects the Ray readiness probe into Ray containers
    checkov.io/skip3: CKV_K8S_22=Ray session dir, spill files and ROCm/Triton caches need a writable root fs
    checkov.io/skip4: CKV_K8S_23=ROCm and CUDA vLLM images run as root; escalation off, capabilities dropped
    checkov.io/skip5: CKV_K8S_40=ROCm and CUDA vLLM images run as root; escalation off, capabilities dropped
    checkov.io/skip6: CKV_K8S_43=pinned by digest when image.digest is set; examples pin a tag
    checkov.io/skip7: CKV_K8S_15=multi-GB images with pinned tags are not re-pulled on every start
    {{- if $isHead }}
    checkov.io/skip8: CKV_K8S_38=the autoscaler sidecar KubeRay adds to the head uses the service-account token
    {{- end }}
spec:
  {{- if not $isHead }}
  automountServiceAccountToken: false
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $spec.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $spec.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $spec.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $isHead }}
      image: {{ include "disagg.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- if $isHead }}
      ports:
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: metrics, containerPort: 8080}
        - {name: serve, containerPort: {{ int $root.Values.serve.port }}}
      {{- else }}
      ports:
        - {name: metrics, containerPort: 8080}
        - {name: serve, containerPort: {{ int $root.Values.serve.port }}}
      {{- end }}
      env:
        {{- range $k, $v := $root.Values.rayEnv }}
        - name: {{ $k }}
          value: {{ $v | toString | quote }}
        {{- end }}
      resources:
        requests:
          cpu: {{ $spec.cpus | quote }}
          memory: {{ printf "%dGi" (int $spec.memoryGi) }}
          {{- if gt (int (default 0 $spec.gpus)) 0 }}
          {{ $root.Values.gpu.resourceName }}: {{ int $spec.gpus }}
          {{- end }}
        limits:
          cpu: {{ $spec.cpus | quote }}
          memory: {{ printf "%dGi" (int $spec.memoryGi) }}
          {{- if gt (int (default 0 $spec.gpus)) 0 }}
          {{ $root.Values.gpu.resourceName }}: {{ int $spec.gpus }}
          {{- end }}
      {{- with $root.Values.containerSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - {name: dshm, mountPath: /dev/shm}
        - {name: haproxy-front, mountPath: {{ include "disagg.haproxyDir" $root }}, readOnly: true}
        {{- if $secret }}
        - {name: api-keys, mountPath: {{ include "disagg.apiKeyDir" $root }}, readOnly: true}
        {{- end }}
        {{- if $disk }}
        - {name: disk-tier, mountPath: {{ $root.Values.app.transfer.disk.path }}}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ printf "%dGi" (int .shmGi) }}
    - name: haproxy-front
      configMap:
        name: {{ include "disagg.fullname" $root }}-haproxy
        defaultMode: 0555
    {{- if $secret }}
    - name: api-keys
      secret:
        secretName: {{ $secret }}
        defaultMode: 0440
        items:
          - {key: {{ $root.Values.apiKey.secretKey }}, path: {{ $root.Values.apiKey.secretKey }}}
    {{- end }}
    {{- if $disk }}
    {{- $sizeGi := add1 (int (mulf $root.Values.app.transfer.disk.capacity_gb 1.05)) }}
    - name: disk-tier
      {{- if eq $root.Values.diskTier.volume "hostPath" }}
      hostPath:
        path: {{ $root.Values.diskTier.hostPath }}
        type: DirectoryOrCreate
      {{- else if eq $root.Values.diskTier.volume "ephemeral" }}
      ephemeral:
        volumeClaimTemplate:
          spec:
            accessModes: [ReadWriteOnce]
            {{- with $root.Values.diskTier.storageClassName }}
            storageClassName: {{ . }}
            {{- end }}
            resources:
              requests:
                storage: {{ printf "%dGi" $sizeGi }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ printf "%dGi" $sizeGi }}
      {{- end }}
    {{- end }}
{{- end -}}
