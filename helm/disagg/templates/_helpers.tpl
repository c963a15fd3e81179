{{/* Names and labels. */}}
{{- define "disagg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name; kept short because KubeRay derives pod and service names from it. */}}
{{- define "disagg.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "disagg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "disagg.labels" -}}
{{ include "disagg.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "disagg.serveServiceName" -}}
{{- printf "%s-serve" (include "disagg.fullname" .) -}}
{{- end -}}

{{- define "disagg.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the API keys ("" when auth is off). */}}
{{- define "disagg.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.create -}}
{{- printf "%s-api-keys" (include "disagg.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "disagg.apiKeyDir" -}}/etc/disagg/api-keys{{- end -}}

{{/* Where the HAProxy shim is mounted (values rayEnv.RAY_SERVE_HAPROXY_BINARY_PATH points into it). */}}
{{- define "disagg.haproxyDir" -}}/etc/disagg/haproxy{{- end -}}

{{/* The Ray custom resources a worker group's pods advertise (a JSON object). */}}
{{- define "disagg.groupRayResources" -}}
{{- $g := .group -}}
{{- $res := dict -}}
{{- if or (eq $g.role "prefill") (eq $g.role "mixed") -}}{{- $_ := set $res "disagg_prefill" 1000 -}}{{- end -}}
{{- if or (eq $g.role "decode") (eq $g.role "mixed") -}}{{- $_ := set $res "disagg_decode" 1000 -}}{{- end -}}
{{- if and (gt (int $g.gpus) 0) .root.Values.gpu.acceleratorType -}}
{{- $_ := set $res (printf "accelerator_type:%s" .root.Values.gpu.acceleratorType) 1 -}}
{{- end -}}
{{- toJson $res -}}
{{- end -}}

{{/*
The AppConfig the Serve app is built from: .Values.app plus what the chart owns
(HTTP host/port, the API key file, the role resources that pin replicas to groups).
*/}}
{{- define "disagg.appArgs" -}}
{{- $app := deepCopy .Values.app -}}
{{- $http := default dict $app.http -}}
{{- $_ := set $http "host" "0.0.0.0" -}}
{{- $_ := set $http "port" (int .Values.serve.port) -}}
{{- if include "disagg.apiKeySecret" . -}}
{{- $_ := set $http "api_keys_file" (printf "%s/%s" (include "disagg.apiKeyDir" .) .Values.apiKey.secretKey) -}}
{{- end -}}
{{- $_ := set $app "http" $http -}}
{{- $dep := default dict $app.deployment -}}
{{- range $role := list "prefill" "decode" -}}
{{- $rc := default dict (get $dep $role) -}}
{{- $res := default dict $rc.resources -}}
{{- $_ := set $res (printf "disagg_%s" $role) 1 -}}
{{- $_ := set $rc "resources" $res -}}
{{- $_ := set $dep $role $rc -}}
{{- end -}}
{{- $_ := set $app "deployment" $dep -}}
{{- toYaml $app -}}
{{- end -}}

{{/* serveConfigV2: a Serve deploy config, the same shape as deployments/configs/*.yaml. */}}
{{- define "disagg.serveConfig" -}}
proxy_location: {{ .Values.serve.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: {{ int .Values.serve.port }}
applications:
  - name: {{ .Values.serve.appName }}
    route_prefix: {{ .Values.serve.routePrefix }}
    import_path: deployments.app:build_app
    {{- with .Values.serve.runtimeEnv }}
    runtime_env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      {{- include "disagg.appArgs" . | nindent 6 }}
{{- end -}}

{{/* Size of the memory-backed /dev/shm of a worker group, in GiB (object store + host tier + headroom). */}}
{{- define "disagg.shmGi" -}}
{{- $hostMb := 1024 -}}
{{- if and .root.Values.app.transfer .root.Values.app.transfer.host -}}
{{- $hostMb = default 1024 .root.Values.app.transfer.host.capacity_mb -}}
{{- end -}}
{{- $hostGi := div (add (int $hostMb) 1023) 1024 -}}
{{- $headroom := 1 -}}
{{- if hasKey .group "shmHeadroomGi" -}}{{- $headroom = int .group.shmHeadroomGi -}}{{- end -}}
{{- add (int .group.objectStoreGi) $hostGi $headroom -}}
{{- end -}}
